import os
import sys

# Make tests/distributed.py importable as a plain module from every test file.
sys.path.insert(0, os.path.dirname(__file__))

"""The calibrated limits of quantization noise, shared by ``qsdp check`` (its verdicts) and the
accuracy guard (its escalations): how they were calibrated is :mod:`qsdp.check.verdict`'s doc
and docs/check.md. Below both, importing nothing, so neither imports the other for them."""

import math

TOLERANCE = 0.003                       # final-loss gap taken as harmless
CALIBRATION_WEIGHT_RATIO = 22.6         # qw4's measured weight error / step (total)
CALIBRATION_GAP = 0.036                 # qw4's measured mean gap
GAP_PER_RATIO_SQ = CALIBRATION_GAP / CALIBRATION_WEIGHT_RATIO ** 2
WEIGHT_RATIO_LIMIT = math.sqrt(TOLERANCE / GAP_PER_RATIO_SQ)  # 6.5
GRAD_RATIO_VALIDATED = 0.11             # sdp4bit's largest layer ratio
GRAD_RATIO_LIMIT = 1.0                  # quantization noise = SGD noise
DELTA_LIMIT = 1.0                       # delta-approximation: relative error below 1

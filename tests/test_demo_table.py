"""The demo's comparison: bits per element by kind and level, and the inter-node bytes saved."""

from qsdp.train.demo import demo_table, inter_node_bytes


def _summary(loss, weights, grads):
    def level(bits_intra, bits_inter, n=1000):
        return {"intra": {"bits_per_element": bits_intra, "bytes": bits_intra * n // 8, "elements": n},
                "inter": {"bits_per_element": bits_inter, "bytes": bits_inter * n // 8, "elements": n}}
    return {"final_val_loss": loss, "median_step_time_s": 0.25,
            "wire": {"weights": level(*weights), "grads": level(*grads),
                     "control": {"intra": {"bytes": 0}, "inter": {"bytes": 8}}}}


def test_the_reduction_is_counted_on_the_links_between_nodes():
    base = _summary(2.0, (32, 32), (32, 32))
    ours = _summary(2.01, (32, 4), (8, 4))  # exact weights inside the node cost nothing between nodes
    assert inter_node_bytes(base) == 8008 and inter_node_bytes(ours) == 1008
    rows = demo_table({"fsdp": base, "sdp4bit": ours}).splitlines()
    assert rows[0].split() == ["preset", "val", "loss", "vs", "fsdp", "weights", "intra", "weights", "inter",
                               "grads", "intra", "grads", "inter", "inter-node", "bytes", "reduction", "step", "(median)"]
    assert rows[3].split()[:8] == ["sdp4bit", "2.0100", "+0.50%", "32.00", "4.00", "8.00", "4.00", "1.01"]
    assert "7.94x" in rows[3]

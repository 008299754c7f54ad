"""FlexiCache evaluation and benchmarks (installed as `fc_hf.eval`)."""

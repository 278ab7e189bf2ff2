"""The two things a benchmark measures: inference calls and training steps."""
INFER, TRAIN = "infer", "train"

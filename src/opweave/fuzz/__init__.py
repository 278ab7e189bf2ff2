"""`opweave fuzz`: a differential fuzzer of the whole pipeline (see runner)."""

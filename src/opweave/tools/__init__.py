"""Tooling around the compiler, not part of it: reports that compare engines and
partitioners on the models, rule proofs and rule generation, memory measurement. The
compiler never imports this package; the CLI, the benchmarks and the tests do."""

"""The searches that fill the tuning database: `opweave tune MODEL` measures a model's
whole-graph configurations in worker processes, here or on Ray (search.py, worker.py,
runners.py), and `opweave tune show|stats|export|import` looks into the database (cli.py).
The compiler never imports this package; it only reads what it wrote (`opweave.tune`)."""

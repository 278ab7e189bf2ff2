"""Graph substitution: rules as data, equality saturation with egglog, ILP extraction."""

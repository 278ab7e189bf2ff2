"""Graph passes: rewriting by verified rules (equality saturation, greedy, backtracking)."""

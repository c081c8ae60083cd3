"""MLX: the candidate kind (kind.py), mlx-lm's models run with their capture points tapped."""

"""flower-app: a Flower / PyTorch app."""

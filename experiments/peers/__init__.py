"""The reference peer, TensorFlow Privacy 0.9.0, run in its own environment, and parity checks."""

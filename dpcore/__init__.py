"""dpcore: differentially private training for TensorFlow 2 / Keras 3."""

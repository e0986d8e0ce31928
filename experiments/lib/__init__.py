"""The shared library of dpcore's programs: imports dpcore, never a program of `experiments/`."""

"""The study: reproduce.py runs the paper's experiments at small scale (README.md here)."""

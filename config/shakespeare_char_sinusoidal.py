# config/shakespeare_char.py with sinusoidal positions instead of xpos.
from config.shakespeare_char import *  # noqa: F401,F403

pos = "sinusoidal"
out_dir = "out/shakespeare_char_sinusoidal"

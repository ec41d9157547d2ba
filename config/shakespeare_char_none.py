# config/shakespeare_char.py with none positions instead of xpos.
from config.shakespeare_char import *  # noqa: F401,F403

pos = "none"
out_dir = "out/shakespeare_char_none"

# config/shakespeare_char.py with learned positions instead of xpos.
from config.shakespeare_char import *  # noqa: F401,F403

pos = "learned"
out_dir = "out/shakespeare_char_learned"

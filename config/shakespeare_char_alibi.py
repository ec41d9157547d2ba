# config/shakespeare_char.py with alibi positions instead of xpos.
from config.shakespeare_char import *  # noqa: F401,F403

pos = "alibi"
out_dir = "out/shakespeare_char_alibi"

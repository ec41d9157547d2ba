# config/shakespeare_char_passkey.py with rope positions instead of xpos.
from config.shakespeare_char_passkey import *  # noqa: F401,F403

pos = "rope"
out_dir = "out/shakespeare_char_passkey_rope"

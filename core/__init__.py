"""polyspec: hardware-neutral EAGLE speculative decoding."""

"""Workers: one decode round for a batch of requests (EAGLE speculative or plain)."""

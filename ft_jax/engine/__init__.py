"""Generation: the jit-compiled prefill and decode steps over offloaded experts, and the Engine that runs them."""

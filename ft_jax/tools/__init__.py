"""Tools around decoding: the bandwidth profile."""

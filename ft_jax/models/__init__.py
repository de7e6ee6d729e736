"""Model families: the decoder, its layers and the routers."""

"""Model families: layers.py (parameter stacks, attention inputs, projections, norms, RoPE), attention.py
(grouped-query attention), mla.py (DeepSeek's latent attention), routing.py (routers), moe.py (MoE blocks and the
expert-backend protocol), decoder.py (decoder layer, scanned stacks, the model)."""

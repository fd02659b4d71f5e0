"""pasa-diffusers: overflow-free FP16 attention (PASA) for video diffusion."""

"""latents"""

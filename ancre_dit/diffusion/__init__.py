"""diffusion"""

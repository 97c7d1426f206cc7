"""prefixgym.envs"""

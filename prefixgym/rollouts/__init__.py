"""prefixgym.rollouts"""

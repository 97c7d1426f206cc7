"""prefixgym.trainer"""

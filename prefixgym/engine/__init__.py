"""prefixgym.engine"""

"""prefixgym.prompting"""

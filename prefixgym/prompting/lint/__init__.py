"""prefixgym.prompting.lint"""

"""(see servicekit/__init__.py)"""

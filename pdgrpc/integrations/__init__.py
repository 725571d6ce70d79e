"""Adapters that put pdgrpc's transfer layer inside other serving engines.

Nothing in the core package imports this package (an ``import-linter`` contract keeps
it so): each adapter imports its engine, which the core never needs.
"""

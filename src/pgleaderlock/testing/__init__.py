"""Helpers for testing code that uses pgleaderlock (throwaway PostgreSQL clusters)."""

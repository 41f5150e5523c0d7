"""Elastic replicas: torchft's Manager and process group as flexdemo's replica group (group.py)."""

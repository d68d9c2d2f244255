"""allreduce"""

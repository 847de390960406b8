"""lorafleet.train"""

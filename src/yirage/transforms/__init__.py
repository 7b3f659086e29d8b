"""Graph → schedule passes (fusion). Each pass keeps the reference interpreter's numbers."""

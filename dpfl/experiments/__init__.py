"""Paper reproductions: presets, runners, report writers."""

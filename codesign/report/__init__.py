"""What a sweep found, read from the results DB: tables (pandas), figures (matplotlib), one HTML page.

`frame` turns attempts into labelled rows and plans, `tables` answers the users' questions,
`figures` draws them, `render` writes report.html, the PNGs and the CSVs. Pure: never imports JAX.
"""

"""Reading results from disk: tidy tables (`tables`), paired statistics (`stats`) and figures
(`figures`). Nothing here imports torch or fla.
"""

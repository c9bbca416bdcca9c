"""Reading results from disk: the tidy frame (`tidy`), the tables papers print (`tables`, RULER's own view in
`ruler`), paired statistics (`stats`, with `pairing`, `p_values` and `comparison_tables`), figures
(`figures`) and the HTML report (`report`, `report_samples`); `formatting` writes values and tables for all
of them. Nothing here imports torch or fla.
"""

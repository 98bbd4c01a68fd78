"""Stage 3, the analysis: the paper's tables from per-head records (:mod:`.tables`, the registry
and the builders; with :mod:`.statistics`, :mod:`.intervals` and :mod:`.rendering`), the squared
norms of Figures 2 and 5 (:mod:`.norms`), the comparison with the published numbers
(:mod:`.comparison`) and the tables as HTML for the report (:mod:`.report`)."""

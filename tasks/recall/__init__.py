"""The recall-intensive tasks of the Based / JRT papers (SWDE, FDA, SQuAD, TriviaQA, NQ, DROP); see README.md."""

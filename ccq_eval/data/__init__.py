"""The embedded corpora (State of the Union, King James Bible, Jane Austen) and the reader of users' corpora."""

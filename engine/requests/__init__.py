"""What a request is and the generic path it takes: its params and rules, how large its answer
will be, the plan that turns it into sequences and results.
"""

-- Answer OK and change nothing: the breaker's probe of a model (extproc.routing.lease_table
-- `_recover_model`). Its KEYS are those of a new session's admission, so Redis routes and checks
-- it as it would that admission (a slot being moved answers TRYAGAIN to both).
return {'OK'}

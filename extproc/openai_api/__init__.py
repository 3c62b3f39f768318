"""The OpenAI API as the router reads it: the request (request), who the client is and which
conversation a request belongs to (sessions), Responses chains by previous_response_id (chains),
and what a request loses or gains before it reaches a provider (adaptation)."""

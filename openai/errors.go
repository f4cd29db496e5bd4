package openai

import (
	"encoding/json"
	"net/http"
	"strconv"
)

// Error is the OpenAI error object, the value of "error" in an error body:
//
//	{"error": {"message": "...", "type": "invalid_request_error", "param": "messages", "code": null}}
//
// Status is the HTTP status it is sent with (not serialized).
type Error struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	// Code is a string for gateway errors; engines may send an integer
	// (vLLM: the HTTP status) or null.
	Code   any `json:"code"`
	Status int `json:"-"`
}

// Error implements error.
func (e *Error) Error() string { return e.Message }

// ErrorResponse is the body of an error reply.
type ErrorResponse struct {
	Error *Error `json:"error"`
}

// Error codes used by the gateway (the "code" field).
const (
	CodeModelNotFound   = "model_not_found"
	CodeRequestTooLarge = "request_too_large"
	CodeNoEndpoint      = "no_endpoint_available"
	CodeUpstream        = "upstream_error"
	CodeInvalidJSON     = "invalid_json"
	CodeInvalidValue    = "invalid_value"
)

// NewError returns an error object for status with message, naming the
// offending request field param ("" for none) and a machine-readable code
// ("" for none). The type follows OpenAI's convention for the status.
func NewError(status int, message, param, code string) *Error {
	e := &Error{Message: message, Type: errorType(status), Status: status}
	if param != "" {
		e.Param = &param
	}
	if code != "" {
		e.Code = code
	}
	return e
}

// Errorf is shorthand for a 400 invalid_request_error about field param.
func Errorf(param, message string) *Error {
	return NewError(http.StatusBadRequest, message, param, CodeInvalidValue)
}

func errorType(status int) string {
	switch {
	case status == http.StatusUnauthorized:
		return "authentication_error"
	case status == http.StatusForbidden:
		return "permission_error"
	case status == http.StatusTooManyRequests:
		return "rate_limit_error"
	case status == http.StatusServiceUnavailable:
		return "service_unavailable_error"
	case status >= 500:
		return "server_error"
	default:
		return "invalid_request_error"
	}
}

// WriteError writes e as a JSON error body with e.Status (500 if unset).
func WriteError(w http.ResponseWriter, e *Error) {
	status := e.Status
	if status == 0 {
		status = http.StatusInternalServerError
	}
	body, _ := json.Marshal(ErrorResponse{Error: e})
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

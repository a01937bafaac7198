package proxy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
)

// hopHeaders are removed on every hop (RFC 9110 section 7.6.1), in addition
// to the headers named in Connection.
var hopHeaders = []string{
	"Keep-Alive",
	"Proxy-Connection",
	"Proxy-Authenticate",
	"Proxy-Authorization",
	"Te",
	"Trailer",
	"Transfer-Encoding",
	"Upgrade",
}

func isUpgrade(h http.Header) bool {
	for _, v := range h.Values("Connection") {
		for _, f := range strings.Split(v, ",") {
			if strings.EqualFold(strings.TrimSpace(f), "upgrade") {
				return true
			}
		}
	}
	return false
}

// stripHopRequest removes hop-by-hop request headers. WebSocket upgrades keep
// Connection and Upgrade (goproxy needs them for the handshake).
func stripHopRequest(h http.Header) {
	upgrade := isUpgrade(h)
	for _, v := range h.Values("Connection") {
		for _, f := range strings.Split(v, ",") {
			f = strings.TrimSpace(f)
			if f != "" && !(upgrade && strings.EqualFold(f, "upgrade")) {
				h.Del(f)
			}
		}
	}
	for _, k := range hopHeaders {
		if upgrade && k == "Upgrade" {
			continue
		}
		h.Del(k)
	}
	if !upgrade {
		h.Del("Connection")
	}
}

func stripHopResponse(resp *http.Response) {
	if resp.StatusCode == http.StatusSwitchingProtocols {
		return
	}
	h := resp.Header
	for _, v := range h.Values("Connection") {
		for _, f := range strings.Split(v, ",") {
			if f = strings.TrimSpace(f); f != "" && !strings.EqualFold(f, "close") {
				h.Del(f)
			}
		}
	}
	for _, k := range hopHeaders {
		if k == "Transfer-Encoding" {
			continue // owned by the response framing, not the header map
		}
		h.Del(k)
	}
}

func hostPort(u *url.URL) string {
	port := u.Port()
	if port == "" {
		if u.Scheme == "https" {
			port = "443"
		} else {
			port = "80"
		}
	}
	return net.JoinHostPort(u.Hostname(), port)
}

// bytesResponse builds a complete response with a known length, so goproxy
// keeps Content-Length instead of re-framing the body chunked.
func bytesResponse(req *http.Request, code int, h http.Header, body []byte) *http.Response {
	if h == nil {
		h = http.Header{}
	}
	h.Del("Content-Encoding")
	h.Del("Transfer-Encoding")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	return &http.Response{
		Status:        fmt.Sprintf("%d %s", code, http.StatusText(code)),
		StatusCode:    code,
		Proto:         "HTTP/1.1",
		ProtoMajor:    1,
		ProtoMinor:    1,
		Header:        h,
		Body:          io.NopCloser(bytes.NewReader(body)),
		ContentLength: int64(len(body)),
		Request:       req,
	}
}

func marshal(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		b = []byte(`{"error":"internal_error"}`)
	}
	return append(b, '\n')
}

// jsonResponse is a synthetic JSON answer that must not be cached.
func jsonResponse(req *http.Request, code int, v any) *http.Response {
	h := http.Header{}
	h.Set("Content-Type", "application/json")
	h.Set("Cache-Control", "no-store")
	return bytesResponse(req, code, h, marshal(v))
}

func errorResponse(req *http.Request, code int, kind, msg string) *http.Response {
	return jsonResponse(req, code, map[string]any{"error": kind, "message": msg})
}

func refusedResponse(req *http.Request, host string) *http.Response {
	return errorResponse(req, http.StatusForbidden, "refused_destination", "pollgate does not forward to "+host)
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	_, _ = w.Write(marshal(v))
}

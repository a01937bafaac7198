package proxy

import (
	"bytes"
	"compress/gzip"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strings"
)

// bodyRead is what readBody took from a response.
type bodyRead struct {
	Body     []byte // the body (decompressed), nil when TooLarge or Stream
	TooLarge bool   // more than the limit: not buffered further
	Stream   bool   // a streaming response (text/event-stream): never buffered
}

// isStream reports a response that must never be buffered.
func isStream(h http.Header) bool {
	mt, _, _ := mime.ParseMediaType(h.Get("Content-Type"))
	return mt == "text/event-stream"
}

// readBody reads a response body for classification: at most max bytes
// (io.LimitReader(max+1) tells "exactly max" from "more"), decompressing
// gzip that the transport left encoded, never reading a stream. The body is
// always closed. A read error mid-body is returned (the caller counts it as
// a transport failure).
func readBody(resp *http.Response, max int64) (bodyRead, error) {
	defer resp.Body.Close()
	if isStream(resp.Header) {
		return bodyRead{Stream: true}, nil
	}
	var r io.Reader = resp.Body
	if strings.EqualFold(strings.TrimSpace(resp.Header.Get("Content-Encoding")), "gzip") && !resp.Uncompressed {
		zr, err := gzip.NewReader(resp.Body)
		if err != nil {
			return bodyRead{}, fmt.Errorf("failed to read gzip body: %w", err)
		}
		defer zr.Close()
		r = zr
		resp.Header.Del("Content-Encoding")
	}
	b, err := io.ReadAll(io.LimitReader(r, max+1))
	if err != nil {
		return bodyRead{}, fmt.Errorf("failed to read response body: %w", err)
	}
	if int64(len(b)) > max {
		return bodyRead{TooLarge: true}, nil
	}
	return bodyRead{Body: b}, nil
}

// peekBody reads up to max bytes of a body that may have to be passed on
// untouched. It returns the bytes read, whether the body is larger, and a
// replacement body that yields the full original content (the bytes read,
// then the rest). The caller owns closing the replacement.
func peekBody(body io.ReadCloser, max int64) ([]byte, bool, io.ReadCloser, error) {
	b, err := io.ReadAll(io.LimitReader(body, max+1))
	if err != nil {
		body.Close()
		return nil, false, nil, err
	}
	if int64(len(b)) <= max {
		body.Close()
		return b, false, io.NopCloser(bytes.NewReader(b)), nil
	}
	return b, true, struct {
		io.Reader
		io.Closer
	}{io.MultiReader(bytes.NewReader(b), body), body}, nil
}

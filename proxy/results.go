package proxy

import (
	"net/url"
	"strings"
	"sync"

	"github.com/tidwall/gjson"

	"pollgate/ledger"
	"pollgate/rules"
)

// resultIndex remembers the result URL of each succeeded operation this
// process has seen, so result calls whose URL holds no job id - a file id
// from the success body ("GET /v1/files/{output_file_id}/content") or a URL
// field ("GET {results_url}") - are still tied to their operation and
// recorded as an action (R23). It is rebuilt lazily: a status call answered
// from a succeeded record adds the record again after a restart.
type resultIndex struct {
	mu sync.Mutex
	m  map[string]ledger.Key
}

const maxResultIndex = 100_000

func newResultIndex() *resultIndex { return &resultIndex{m: map[string]ledger.Key{}} }

// resultKey normalises a URL for lookup: scheme, lower-case host without
// default port, escaped path. The query is ignored (download flags).
func resultKey(u *url.URL) string {
	v := matchURL(u)
	return strings.ToLower(v.Scheme) + "://" + strings.ToLower(v.Host) + v.EscapedPath()
}

func (ri *resultIndex) add(raw string, key ledger.Key) {
	u, err := url.Parse(raw)
	if err != nil || u.Host == "" {
		return
	}
	ri.mu.Lock()
	defer ri.mu.Unlock()
	if len(ri.m) >= maxResultIndex {
		ri.m = map[string]ledger.Key{}
	}
	ri.m[resultKey(u)] = key
}

func (ri *resultIndex) lookup(u *url.URL) (ledger.Key, bool) {
	ri.mu.Lock()
	defer ri.mu.Unlock()
	k, ok := ri.m[resultKey(u)]
	return k, ok
}

// resultURLOf computes where the result of a succeeded operation is
// fetched: the record's ResultURL, or the contract's result template
// expanded with the status call's placeholders and the success body's
// fields. "" when the contract has no result call or a value is missing.
func resultURLOf(prov *rules.Provider, op *rules.Operation, statusParams map[string]string) string {
	if op.ResultURL != "" {
		return op.ResultURL
	}
	if prov.Result == nil || op.Terminal == nil {
		return ""
	}
	t := prov.Result.Request
	params := map[string]string{"job_id": op.JobID}
	for k, v := range statusParams {
		params[k] = v
	}
	for _, ph := range t.Placeholders() {
		if _, ok := params[ph]; ok {
			continue
		}
		if r := gjson.GetBytes(op.Terminal.Body, ph); r.Exists() && r.Type != gjson.Null {
			params[ph] = r.String()
		}
	}
	u, err := t.Expand(params, prov.BaseURL)
	if err != nil {
		return ""
	}
	return u
}

// indexResult records a succeeded operation's result URL.
func (p *Proxy) indexResult(prov *rules.Provider, op *rules.Operation, statusParams map[string]string) {
	if op == nil || op.Phase != rules.PhaseSucceeded {
		return
	}
	if u := resultURLOf(prov, op, statusParams); u != "" {
		p.results.add(u, ledger.KeyOf(op))
	}
}

"""A LangGraph tool-calling agent (LangChain's `ChatOpenAI.bind_tools`, a `ToolNode`), trained as it is written:
`rollout.agent.entrypoint=examples/agent_frameworks/langgraph_tools_agent.py:run`. The model's reply calls the tool
(read into `tool_calls` by the endpoint), the ToolNode runs it, and the model answers from its output."""

from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition


@tool
def add(a: int, b: int) -> int:
    """Adds two integers."""
    return a + b


def build_graph(llm):
    async def agent(state: MessagesState):
        return {"messages": [await llm.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode([add]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)  # (a reply with tool calls: to the tools, else the end)
    graph.add_edge("tools", "agent")
    return graph.compile()


async def run(sample, client):
    llm = ChatOpenAI(model="policy", base_url=str(client.base_url), api_key=client.api_key, max_retries=0)
    graph = build_graph(llm.bind_tools([add]))
    state = await graph.ainvoke({"messages": [HumanMessage(sample["prompt"])]}, {"recursion_limit": 8})
    return float(state["messages"][-1].content.strip() == str(sample["extra"]["ground_truth"]))
